"""python -m services.ingress"""

from services.common.service_main import run_main
from services.ingress.config import IngressConfig
from services.ingress.server import create_server

if __name__ == "__main__":
    run_main(IngressConfig.load, create_server, service="ingress")
