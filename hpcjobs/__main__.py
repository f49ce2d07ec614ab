from hpcjobs.cli import main

raise SystemExit(main())
