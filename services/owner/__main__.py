"""python -m baton_runtime.owner"""

from baton_runtime.common.rpc.main import run_main
from baton_runtime.owner.config import OwnerConfig
from baton_runtime.owner.server import create_server

if __name__ == "__main__":
    run_main(OwnerConfig.load, create_server, service="owner")
