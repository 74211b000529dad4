"""``python -m gateway`` is the same program as the ``gateway`` command."""

from gateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
