"""`python -m kvstream`: the same as the `kvstream` command."""

from kvstream.cli.main import main

raise SystemExit(main())
