"""`python -m kvstream`: the same as the `kvstream` command."""

from kvstream._cli.main import main

raise SystemExit(main())
