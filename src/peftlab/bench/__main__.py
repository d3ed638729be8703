from peftlab.bench.suite.suite import main

raise SystemExit(main())
