# Image for the controller, operator and agent (charts/mixfleet uses one image for all).
# Build: docker build -t ghcr.io/mixfleet/mixfleet:0.1.0 .
# The agent's NVML discovery needs the NVIDIA container runtime (runtimeClassName: nvidia),
# which mounts the driver's libnvidia-ml into the container.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY policies policies
COPY controlplane controlplane
COPY agents agents
COPY operators operators
COPY apis apis
COPY proto proto
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin mixfleet
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 65532
ENTRYPOINT ["mixfleetctl"]
CMD ["--help"]
