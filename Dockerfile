# One image for every Fleetpilot service; the command picks the service:
#   docker run fleetpilot:dev python -m fleetpilot_services.policy
# GPUs are not baked in: on GPU nodes the NVIDIA container runtime mounts the driver's
# libnvidia-ml.so and /dev/nvidia*, which nvidia-ml-py (pure Python) loads at run time.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLEETPILOT_STATE_DIR=/var/lib/fleetpilot

WORKDIR /app

# CPU-only torch first, from its own index: the default wheel drags in ~3 GB of CUDA
# libraries that nothing here uses (only the learner trains with torch, a small model on
# CPU; the policy serves it with numpy), and installing it before the project makes
# `pip install .` see the pin already satisfied.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The project's dependencies next, read from pyproject.toml alone, so that this layer is built
# again only when they change: installed by `pip install .` after the code was copied, every
# one of them was downloaded again at each change of the code.
# README is optional at build time (the glob keeps COPY from failing when it is absent).
COPY pyproject.toml README.m[d] ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# The code: `pip install .` finds every dependency installed above and downloads none.
COPY libs ./libs
COPY services ./services
COPY proto ./proto
RUN pip install . \
    && python -c "import fleetpilot.contracts, fleetpilot_services"

# Run unprivileged; the state dir holds SQLite files and caches when no PostgreSQL is set.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/fleetpilot fleetpilot \
    && mkdir -p /var/lib/fleetpilot \
    && chown fleetpilot:fleetpilot /var/lib/fleetpilot
USER 10001
WORKDIR /var/lib/fleetpilot

# /metrics and /healthz: collector 9101, topology 9102, fingerprinter 9103, sla 9104,
# policy 9105, executor 9106, feedback 9107, learner 9108 (docker-compose.yml and
# deploy/k8s set each service's FLEETPILOT_<SERVICE>_METRICS_PORT to these; the default is
# a free port).
EXPOSE 9101 9102 9103 9104 9105 9106 9107 9108

CMD ["python", "-m", "fleetpilot_services.policy"]
