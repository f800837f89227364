"""The Redfish emulator (sushy-tools, `--fake`) as the simulated fleet runs it.

The emulator's fake driver applies a power change 1 to 11 seconds after it was asked for, as
hardware does. `--power-delay LOW HIGH` (before the emulator's own arguments) draws that delay
from LOW to HIGH seconds instead (`bmc.emulator_power_delay_s`): the demo and the tests wait for
the same power changes, only less long. Nothing else of the emulator changes.
"""

from __future__ import annotations

import random
import sys

from sushy_tools.emulator import main as emulator
from sushy_tools.emulator.resources.systems import fakedriver

from gpucloud.config import power_delay_range


class PowerDelays:
    """Stands in for the `random` module inside the fake driver, which draws only the delay of a
    power change from it (`randint(1, 11)`)."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = power_delay_range(low, high)

    def randint(self, a: int, b: int) -> int:
        return random.randint(self.low, self.high)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--power-delay"]:
        fakedriver.random = PowerDelays(int(args[1]), int(args[2]))
        args = args[3:]
    sys.argv = ["sushy-emulator", *args]
    return int(emulator.main())


if __name__ == "__main__":
    sys.exit(main())
