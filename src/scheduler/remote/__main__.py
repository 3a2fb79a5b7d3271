import sys

from scheduler.remote.child import main

sys.exit(main(sys.argv[1:]))
