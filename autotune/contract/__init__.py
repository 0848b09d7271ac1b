"""The contract every process shares: the wire protocol, the knob table and configs, search
spaces and starting points, the quality gate, the verdict's statistics, errors, and the
workload registry and base class. Pydantic and the standard library only: no torch, no
service (tests/test_imports.py holds it to that)."""
