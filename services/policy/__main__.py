"""``python -m fleetpilot_services.policy``: run one replica of the policy service."""

from .service import main

if __name__ == "__main__":
    main()
