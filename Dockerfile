# kvdiag: the exporter (`serve`), the simulated engines (`simulate`) and every CLI command.
#   docker build -t kvdiag .
#   docker run --rm kvdiag diagnose http://engine:8000 --duration 60
# No torch: the reference pool keeps its KV tensors on numpy without it (see pyproject's extras).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvdiag ./kvdiag
RUN pip install . && rm -rf /src

# The exporter and the simulators need no privilege: a fixed non-root uid (Kubernetes'
# runAsNonRoot checks it is numeric).
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvdiag
USER 10001
WORKDIR /home/kvdiag

EXPOSE 10877
ENTRYPOINT ["kvdiag"]
CMD ["--help"]
