"""Test-wide set-up: keep every Ray process of the suite on loopback.

This runs before any test module imports Ray (Ray reads the setting at import time).
"""

from actors.ray_env import set_local_env

set_local_env()
