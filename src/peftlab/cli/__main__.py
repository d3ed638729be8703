from peftlab.cli.main import main

raise SystemExit(main())
