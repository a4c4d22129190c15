"""The Chorus Grafana dashboards as code; ``infra/grafana/build_dashboards.py`` writes them out as JSON."""
