"""`python -m mtplxd ...`: the same CLI as the `mtplxd` console script."""

from mtplxd.cli import main

raise SystemExit(main())
