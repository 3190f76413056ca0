"""Nsight Compute's CSV of gpu__time_duration.sum (bench/decode_step.py --ncu) summed by kernel,
per step: python bench/ncu_kernels.py FILE STEPS"""

import csv
import sys
from collections import defaultdict

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2])
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    total, count = defaultdict(float), defaultdict(int)
    for row in rows:
        if row.get("Metric Name") == "gpu__time_duration.sum":
            name = row["Kernel Name"].split("(")[0].split("[")[0]
            total[name] += float(row["Metric Value"].replace(",", "")) * UNITS[row["Metric Unit"]]
            count[name] += 1
    for name in sorted(total, key=total.get, reverse=True):
        print(f"{total[name] / steps:9.1f} us a step  {count[name] / steps:5.1f} launches  "
              f"{total[name] / count[name]:7.2f} us each  {name}")
    print(f"{sum(total.values()) / steps:9.1f} us a step in {sum(count.values()) / steps:.0f} kernels")


if __name__ == "__main__":
    main()
