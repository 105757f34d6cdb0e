"""``python -m fleetpilot_services.sla``: run one replica of the sla service."""

from .service import main

if __name__ == "__main__":
    main()
