"""python -m services.hooks"""

from services.common.service_main import run_main
from services.hooks.config import HooksConfig
from services.hooks.server import create_server

if __name__ == "__main__":
    run_main(HooksConfig.load, create_server, service="hooks")
