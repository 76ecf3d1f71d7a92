/**
 * The discovered pool of a `serve --discover` (issue 39): the nodes proving the cluster token on the LAN, heard for as
 * long as the server runs, so that a node that appears later is seen (and the pipeline re-planned onto it when that
 * is better: src/layers/server/Replan.ts). The live layer listens on the discovery port
 * (src/layers/discovery/DiscoveredPoolLive.ts); the test layer holds a set the test changes.
 */
import { Context, type Effect } from "effect"
import type { DiscoveryView } from "../domain/discovery.js"

export interface DiscoveredPoolService {
  /** The nodes heard now (expired ones gone, conflicted ids refused), with every sender not used and why. */
  readonly view: Effect.Effect<DiscoveryView>
  /**
   * The orchestrator found the node at this control address dead (its connection lost): it is not listed again from
   * an announcement of the same run, only once it restarts.
   */
  readonly bury: (address: string) => Effect.Effect<void>
}

export class DiscoveredPool extends Context.Tag("swactor/DiscoveredPool")<DiscoveredPool, DiscoveredPoolService>() {}

/** The control addresses of the nodes a view would use, in the view's order (by address). */
export const poolAddresses = (view: DiscoveryView): ReadonlyArray<string> => view.verified.map((node) => node.address)
