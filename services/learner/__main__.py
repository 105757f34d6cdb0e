"""``python -m fleetpilot_services.learner``: run one replica of the learner service."""

from .service import main

if __name__ == "__main__":
    main()
