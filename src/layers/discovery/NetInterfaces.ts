/**
 * The IPv4 interfaces discovery speaks on (issue 39): every interface that is up with an IPv4 address, leaving out
 * virtual ones (docker*, veth*, br-*, virbr*) and loopback unless asked (`loopback`, for tests on one host), or exactly
 * the interfaces named. Each with its address and its broadcast address (from the netmask).
 */
import * as Os from "node:os"

export interface DiscoveryInterface {
  readonly name: string
  readonly address: string
  readonly broadcast: string
}

const VIRTUAL = /^(docker|veth|br-|virbr)/

/** Which interfaces: exactly `only` when given, else every non-virtual one (loopback too when `loopback`). */
export interface InterfaceChoice {
  readonly only?: ReadonlyArray<string> | undefined
  readonly loopback?: boolean | undefined
  /** Loopback interfaces only (a node bound to a loopback address is reached from this host only). */
  readonly loopbackOnly?: boolean | undefined
}

const octets = (ip: string) => ip.split(".").map(Number)

/** The broadcast address of `address` under `netmask`. */
export const broadcastOf = (address: string, netmask: string): string => {
  const mask = octets(netmask)
  return octets(address)
    .map((byte, i) => (byte | (~(mask[i] ?? 0) & 0xff)) & 0xff)
    .join(".")
}

/** The interfaces chosen, from `table` (default: this host's). */
export const discoveryInterfaces = (
  choice: InterfaceChoice = {},
  table: NodeJS.Dict<Array<Os.NetworkInterfaceInfo>> = Os.networkInterfaces()
): ReadonlyArray<DiscoveryInterface> =>
  Object.entries(table).flatMap(([name, infos]) => {
    const wanted =
      choice.only !== undefined
        ? choice.only.includes(name)
        : choice.loopbackOnly === true
          ? (infos ?? []).some((i) => i.internal)
          : !VIRTUAL.test(name) && (choice.loopback === true || !(infos ?? []).some((i) => i.internal))
    if (!wanted) return []
    return (infos ?? [])
      .filter((info) => info.family === "IPv4")
      .map((info) => ({ name, address: info.address, broadcast: broadcastOf(info.address, info.netmask) }))
  })
