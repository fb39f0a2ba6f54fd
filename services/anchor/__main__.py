"""python -m services.anchor"""

from services.anchor.config import AnchorConfig
from services.anchor.server import create_server
from services.common.service_main import run_main

if __name__ == "__main__":
    run_main(AnchorConfig.load, create_server, service="anchor")
