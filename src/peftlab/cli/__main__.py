from peftlab.cli.main.main import main

raise SystemExit(main())
