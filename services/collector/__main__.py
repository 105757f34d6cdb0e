"""``python -m fleetpilot_services.collector``: run one replica of the collector service."""

from .service import main

if __name__ == "__main__":
    main()
