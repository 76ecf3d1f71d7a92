import { Schema } from "effect"

/** A run, unique per orchestrator. */
export const RunId = Schema.Number.pipe(Schema.int(), Schema.nonNegative(), Schema.brand("RunId"))
export type RunId = typeof RunId.Type

/** A node (machine / agent) known to the orchestrator. */
export const NodeId = Schema.Number.pipe(Schema.int(), Schema.nonNegative(), Schema.brand("NodeId"))
export type NodeId = typeof NodeId.Type

/** An edge of a run's data-flow graph, unique within the run. */
export const EdgeId = Schema.Number.pipe(Schema.int(), Schema.nonNegative(), Schema.brand("EdgeId"))
export type EdgeId = typeof EdgeId.Type

/** The role a stage plays in a run (its stage index). */
export const RoleId = Schema.Number.pipe(Schema.int(), Schema.nonNegative(), Schema.brand("RoleId"))
export type RoleId = typeof RoleId.Type

/** A named port on a stage ("input" / "output"). */
export const PortId = Schema.String.pipe(Schema.brand("PortId"))
export type PortId = typeof PortId.Type
