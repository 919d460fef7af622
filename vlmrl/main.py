"""``python -m vlmrl.main config=<yaml> key=value ... [--dry-run | --help [KEY_PREFIX]]``

The config is loaded and validated in full before Ray starts or any model is
read or built, so a mistyped key fails in seconds with every problem listed; the
tiny assets a YAML names as ``${tiny:...}`` are built only after that (never
under ``--dry-run``), with one console line saying what, and their progress in
the run's log.
``--help`` lists every option from the config's attribute docstrings (``--help
worker.rollout`` only those under that prefix); ``--dry-run`` prints the
resolved config and the resource plan and stops there, without Ray or a model.

During the run the terminal shows vlmrl's own lines and a progress bar; the
engines' logs go to ``<experiment dir>/run.log`` (``vlmrl.driver.console``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from vlmrl.config import ConfigError, help_text, to_dict
from vlmrl.config.help import USAGE
from vlmrl.config.redact import mask_text
from vlmrl.plan import describe


def main(argv: list[str] | None = None, hooks=None) -> int:
    """Run ``python -m vlmrl.main ARGS``; ``hooks`` (a ``vlmrl.driver.hooks.RunHooks``) are for tests only."""
    args = sys.argv[1:] if argv is None else argv
    if "--help" in args or "-h" in args:
        at = args.index("--help") if "--help" in args else args.index("-h")
        following = args[at + 1] if at + 1 < len(args) else ""
        prefix = following if "=" not in following and not following.startswith("-") else ""  # --help KEY_PREFIX
        try:
            print(help_text(prefix), flush=True)
        except BrokenPipeError:
            # `--help | head` closes the pipe early; the rest of the text goes nowhere, without a traceback.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    missing = [a for a in args if a.startswith("config=") and not Path(a.removeprefix("config=")).is_file()]
    if missing:
        print(f"vlmrl: {missing[0]}: no such file\n{USAGE}", file=sys.stderr)
        return 2
    from vlmrl.driver.run_lock import RunLocked
    from vlmrl.launch import execute, prepare

    try:
        prepared = prepare(args)
    except ConfigError as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2
    if dry_run:
        print("# resolved config")
        print(yaml.safe_dump(to_dict(prepared.config), sort_keys=False), end="")
        print("\n# plan")
        print(mask_text(describe(prepared.plan, prepared.config)))  # a path built from ${oc.env:...} shows as ***
        if prepared.tiny.missing:
            print(f"not built yet (a run builds them first; --dry-run builds nothing): {prepared.tiny.describe_missing()}")
        return 0
    try:
        return execute(prepared, hooks)
    except (ConfigError, RunLocked) as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
