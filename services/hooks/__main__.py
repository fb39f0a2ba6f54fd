"""python -m baton_runtime.hooks"""

from baton_runtime.common.rpc.main import run_main
from baton_runtime.hooks.config import HooksConfig
from baton_runtime.hooks.server import create_server

if __name__ == "__main__":
    run_main(HooksConfig.load, create_server, service="hooks")
