"""``python -m fleetpilot_services.topology``: run one replica of the topology service."""

from .service import main

if __name__ == "__main__":
    main()
