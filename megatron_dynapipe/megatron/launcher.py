"""``python -m megatron_dynapipe.megatron.launcher``: the launcher (:mod:`megatron_dynapipe.megatron_lm.launcher`)
under the name the documentation, ``update_pretrain_gpt.sh`` and users' scripts start it by.  Imported
rather than run, this name is that module itself."""

import sys

from megatron_dynapipe.megatron_lm import launcher

if __name__ == "__main__":
    sys.exit(launcher.main())
sys.modules[__name__] = launcher
