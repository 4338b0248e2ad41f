"""Compare `pacmpi train --json` results: accuracy (and its drop versus the first, dense run),
throughput, bytes on the wire per step and the step-time split."""
import json
import sys


def main(paths):
    runs = [json.load(open(p)) for p in paths]
    baseline = runs[0]
    print(f"\n{runs[0]['world_size']} ranks, {baseline['parameters']:,} parameters, "
          f"pretrained dense test accuracy {baseline['pretrained_accuracy']:.4f}")
    print(f"{'method':>17} {'ratio':>5} {'accuracy':>8} {'drop':>7} {'samples/s':>9} "
          f"{'bytes/step':>11} {'of dense':>8} {'compute':>8} {'comm':>8} {'pack+unp':>8}")
    for r in runs:
        s, t = r["summary"], r["summary"]["step_seconds"]
        drop = baseline["final_accuracy"] - r["final_accuracy"]
        share = s["bytes_per_step"] / max(s["dense_bytes_per_step"], 1)
        print(f"{r['config']['method']:>17} {r['config']['ratio']:>5.2f} "
              f"{r['final_accuracy']:>8.4f} {drop:>+7.4f} {s['samples_per_second']:>9.0f} "
              f"{s['bytes_per_step']:>11,.0f} {share:>8.1%} {t['compute']:>8.4f} "
              f"{t['comm']:>8.4f} {t['pack'] + t['unpack']:>8.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
