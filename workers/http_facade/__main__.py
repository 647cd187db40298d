from workers.http_facade.server import main

raise SystemExit(main())
