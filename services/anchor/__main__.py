"""python -m baton_runtime.anchor"""

from baton_runtime.anchor.config import AnchorConfig
from baton_runtime.anchor.server import create_server
from baton_runtime.common.rpc.main import run_main

if __name__ == "__main__":
    run_main(AnchorConfig.load, create_server, service="anchor")
