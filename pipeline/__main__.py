import sys

from .errors import missing_dependency

try:
    from .cli import main
except ModuleNotFoundError as exc:  # not even pyyaml/pydantic: the CLI cannot start
    print(missing_dependency(exc), file=sys.stderr)
    raise SystemExit(2) from None

raise SystemExit(main())
