"""MinAtar's gymnasium ids, registered on import (importing `minatar` alone registers none).

  python sebulba_impala.py --env-id tests.minatar_envs:MinAtar/Breakout-v1
"""

import gymnasium as gym
import minatar.gym
import numpy as np

minatar.gym.register_envs()


def random_play(name, episodes, seed):
    """The mean score of uniformly random actions over `episodes` whole games of `name`."""
    env, rng, scores = gym.make(name), np.random.default_rng(seed), []
    env.reset(seed=seed)
    while len(scores) < episodes:
        score, over = 0.0, False
        while not over:
            _, reward, terminated, truncated, _ = env.step(rng.integers(env.action_space.n))
            score, over = score + reward, terminated or truncated
        scores.append(score)
        env.reset()
    return float(np.mean(scores))
