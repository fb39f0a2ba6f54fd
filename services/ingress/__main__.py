"""python -m baton_runtime.ingress"""

from baton_runtime.common.rpc.main import run_main
from baton_runtime.ingress.config import IngressConfig
from baton_runtime.ingress.server import create_server

if __name__ == "__main__":
    run_main(IngressConfig.load, create_server, service="ingress")
