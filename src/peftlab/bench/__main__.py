from peftlab.bench.cli import main

raise SystemExit(main())
