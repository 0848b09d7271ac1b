"""The worker: the process on a GPU host that leases trials over HTTP, runs each in a probe
child, and reports the result; its spool keeps results the service could not take. Imports the
contract and starts the engine's children; never optuna or fastapi."""
