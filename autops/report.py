"""pMaster's utilization reports at their documented import path (``autops.report.subscribe``,
the report's format and its text rendering). They live in ``autops.master.report``."""
from .master.report import (REPORT_TYPE, REPORT_VERSION, STATUS_LEGEND, TOPIC, PrometheusExporter, ReportPublisher,
                            ReportSubscriber, cpu_saving, encode_report, format_status, metric_samples, parse_message,
                            pool_cpus, skew_of, subscribe, utilization_report)

__all__ = ["REPORT_VERSION", "REPORT_TYPE", "TOPIC", "utilization_report", "cpu_saving", "pool_cpus", "STATUS_LEGEND",
           "encode_report", "parse_message", "skew_of", "ReportPublisher", "ReportSubscriber", "subscribe",
           "metric_samples", "PrometheusExporter", "format_status"]
