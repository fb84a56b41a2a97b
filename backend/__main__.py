"""`python -m tritonllm`: the `tritonllm` command."""

import sys

from tritonllm.commands.main import main

sys.exit(main())
