"""``python -m fleetpilot_services.feedback``: run one replica of the feedback service."""

from .service import main

if __name__ == "__main__":
    main()
