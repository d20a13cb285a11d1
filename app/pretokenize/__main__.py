from app.pretokenize import main

raise SystemExit(main())
