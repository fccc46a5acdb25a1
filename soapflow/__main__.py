import sys

from soapflow.cli import main

sys.exit(main())
