"""sbpc.codegen_templates"""
