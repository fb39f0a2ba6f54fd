"""python -m services.owner"""

from services.common.service_main import run_main
from services.owner.config import OwnerConfig
from services.owner.server import create_server

if __name__ == "__main__":
    run_main(OwnerConfig.load, create_server, service="owner")
