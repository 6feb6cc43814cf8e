"""MinAtar's gymnasium ids, registered on import (importing `minatar` alone registers none).

  python sebulba_impala.py --env-id tests.minatar_envs:MinAtar/Breakout-v1
"""

import minatar.gym

minatar.gym.register_envs()
