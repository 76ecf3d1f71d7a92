/**
 * Agents' links, the library's `Transport` namespace: the wire's frames and the control RPC's messages, the
 * `DataPlane` / `AgentControl` services and the `Membership` of a pool, and the transports under them: the
 * cluster-token proof (`Auth`), the edge's data plane (`EdgeTransport`) and the control plane (`ControlPlane`).
 * Frame encoding and the shared-memory ring stay inside.
 */
export * from "../domain/frames.js"
export * from "../domain/controlRpc.js"
export * from "../services/AgentLinks.js"
export * from "../services/Membership.js"
export * as Auth from "../layers/transport/Auth.js"
export * as EdgeTransport from "../layers/transport/EdgeTransport.js"
export * as ControlPlane from "../layers/transport/ControlPlane.js"
