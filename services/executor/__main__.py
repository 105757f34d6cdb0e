"""``python -m fleetpilot_services.executor``: run one replica of the executor service."""

from .service import main

if __name__ == "__main__":
    main()
