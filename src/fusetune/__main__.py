import os
import sys

from fusetune.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A torchrun rank ends here, its work done and its output written. os._exit skips the
    # interpreter's teardown, where a C++ thread still joinable (gloo's, DeepSpeed's) called
    # std::terminate now and then ("terminate called without an active exception", SIGABRT on
    # CPU ranks under ZeRO-3, after the model was saved: seen in CI), failing a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
