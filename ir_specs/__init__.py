"""sbpc.ir_specs"""
