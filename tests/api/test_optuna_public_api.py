"""The service reaches Optuna through its public API only (issue 36): no private module
(``optuna.storages._rdb``, ``optuna.samplers._base``, ...) is imported, and no private member of
an Optuna object (a study's storage or thread-local cache, a trial's id, the storage's
transaction helpers) is touched, so an Optuna release within the pinned range cannot break the
service by changing its internals."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = sorted([*(ROOT / "api").rglob("*.py"), *(ROOT / "autotune").rglob("*.py")])
# private members of Optuna objects the service once used; none of our own names look like these
PRIVATE_MEMBERS = {"_storage", "_trial_id", "_study_id", "_thread_local", "_backend", "_get_trials",
                   "_create_new_trial", "_set_trial_value_without_commit", "_set_trial_attr_without_commit",
                   "scoped_session", "check_trial_is_updatable", "_CONSTRAINTS_KEY"}


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "optuna":
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(p.startswith("_") for p in parts):
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "optuna" and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_MEMBERS:
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
    return found


def test_the_product_uses_only_optunas_public_api() -> None:
    assert PRODUCT, "no product modules found"
    found = [use for path in PRODUCT for use in _private_uses(path)]
    assert found == [], "private Optuna API used: " + "; ".join(found)


def test_the_check_would_see_a_private_use(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from optuna.storages._rdb import models\nimport optuna\n"
                   "def f(study):\n    return study._storage, study.trials[0]._trial_id\n")
    assert len(_private_uses(bad)) == 3
