from trainmover.cli import main

raise SystemExit(main())
