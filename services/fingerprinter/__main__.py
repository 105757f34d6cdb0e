"""``python -m fleetpilot_services.fingerprinter``: run one replica of the fingerprinter service."""

from .service import main

if __name__ == "__main__":
    main()
