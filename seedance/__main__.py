"""`python -m seedance` is the `seedance` command."""

from seedance.cli import main

raise SystemExit(main())
