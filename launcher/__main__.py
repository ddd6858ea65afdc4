"""`python -m launcher JOB JOB_IO OUTPUT --context ... --log FILE`: how every rule runs its stage."""
import sys

from launcher.submit import main

sys.exit(main())
