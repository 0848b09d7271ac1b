"""The probe engine: what runs in a probe child. It builds a workload, applies a config's knobs
(compile, precision, checkpointing, optimizer, data path), times the training windows and
validates; also `autotune.apply` on a user's own loop, the distributed launcher and the fork
server the worker starts its children from. Imports the contract, never the service."""
